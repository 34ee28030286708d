"""One rank, bf16 compute over fp32 weights (CUDA's default mixed precision, issue 34): the FSDP engine
keeps the plain module under ``torch.autocast`` instead of an FSDP2 wrapper that has nothing to shard
(``engines/fsdp/engine.py``, "One rank"). On the CPU autocast to bf16 runs the same path, so every
claim is checked here: the path chosen (and ``single_rank=fsdp`` still wrapping), log-probs and one
update against FSDP2's mixed precision within bf16 rounding, fp32 master weights and gradients, bf16
really in use, a checkpoint resuming the next step exactly, and the HF rollout decoding from a bf16
copy of the weights that follows every update. tests/gpu/test_single_gpu_update.py repeats the
numbers on CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.fsdp import FSDPModule

from rlfoundry.config.schema import FSDPConfig, OptimConfig
from rlfoundry.engines.base import LogProbs, MicroBatching, UpdatePlan
from rlfoundry.engines.fsdp import utils as fu
from rlfoundry.engines.fsdp.engine import FSDPEngine, FSDPEngineConfig
from rlfoundry.protocol import DataProto
from rlfoundry.workers.rollout.hf_rollout import HFRollout
from tests.engines.test_fsdp_engine import _batch, _nll
from tests.engines.test_fsdp_utils import process_group  # noqa: F401 - fixture
from tests.engines.test_fsdp_vision import image_batch  # noqa: F401 - fixture

BF16 = {"param_dtype": "bf16"}
# The bounds below, measured on the 2-layer tiny model (8 rows, 24 response tokens): log-probs max
# 2.0e-3 / mean 6.4e-4 apart (each path vs fp32: autocast 1.6e-3 / 4.3e-4, FSDP2 2.3e-3 / 6.7e-4);
# loss rel 1.3e-5, grad norm rel 1.4e-4, gradient (as the weight change of a linear step) rel 5.8e-3.
LOG_PROB_MAX, LOG_PROB_MEAN = 1e-2, 2.5e-3


def _engine(model_dir, mixed=BF16, trainable=True, eps=1e-8, device="cpu", fields=None, **fsdp) -> FSDPEngine:
    """``fields``: more ``FSDPEngineConfig`` fields (lora, model_kind, gradient_checkpointing)."""
    optim = OptimConfig(lr=1.0 if eps >= 1 else 1e-2, weight_decay=0.0, eps=eps) if trainable else None
    config = FSDPEngineConfig(path=str(model_dir), fsdp=FSDPConfig(mixed_precision=dict(mixed), **fsdp),
                              optim=optim, grad_clip=None, cpu_kernels="off", **(fields or {}))
    return FSDPEngine.build(config, device, role="actor" if trainable else "ref")


def _data(device="cpu"):
    return _batch(rows=8, tp=12, tr=24).to(device)


def _head_dtypes(engine) -> list[torch.dtype]:
    """Records the dtype of every LM-head output (what the matmuls computed in)."""
    seen: list[torch.dtype] = []
    head = engine.module.get_output_embeddings()
    head.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    return seen


def _weights(engine) -> dict[str, torch.Tensor]:
    return {n: w.detach().float().cpu().clone() for n, w in engine.iter_hf_weights()}


def _step(engine, data) -> tuple[dict, dict, dict[str, torch.Tensor]]:
    """One update (two micro-batches of 4): its metrics, the gradients the optimiser saw, the weight change."""
    grads: dict[str, torch.Tensor] = {}
    names = {id(p): n for n, p in engine.module.named_parameters()}

    def record(optimizer, *_):
        for p in optimizer.param_groups[0]["params"]:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[names[id(p)]] = (p.dtype, g.detach().clone())

    handle = engine.optimizer.register_step_pre_hook(record)
    before = _weights(engine)
    metrics = engine.train_batch(data, LogProbs(), _nll, UpdatePlan(mini_batch_size=8, micro=MicroBatching(size=4)))
    handle.remove()
    after = _weights(engine)
    return metrics, grads, {n: after[n] - before[n] for n in after}


def _rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    x = torch.cat([a[n].flatten().float() for n in sorted(b)])
    y = torch.cat([b[n].flatten().float() for n in sorted(b)])
    return float((x - y).norm() / y.norm())


def test_one_rank_in_bf16_over_fp32_weights_is_the_plain_module_and_single_rank_fsdp_wraps(process_group,
                                                                                           tiny_model_dir):
    plain = _engine(tiny_model_dir)
    assert not any(isinstance(m, FSDPModule) for m in plain.module.modules())
    assert fu.plain_autocast_dtype(plain.module) == torch.bfloat16
    assert {p.dtype for p in plain.module.parameters()} == {torch.float32}  # the master weights
    wrapped = _engine(tiny_model_dir, single_rank="fsdp")
    assert isinstance(wrapped.module, FSDPModule) and fu.plain_autocast_dtype(wrapped.module) is None
    fp32 = _engine(tiny_model_dir, mixed={})  # computing in its own dtype: plain, nothing to autocast
    assert not isinstance(fp32.module, FSDPModule) and fu.plain_autocast_dtype(fp32.module) is None
    # the decision itself: one rank, no offload, bf16 over fp32 (fp16 keeps FSDP2's policy)
    assert fu.fsdp_does_nothing("cpu", "bf16") and fu.fsdp_does_nothing("cuda", None)
    assert not fu.fsdp_does_nothing("cuda", None, param_offload=True)
    assert not fu.fsdp_does_nothing("cpu", "fp16") and not fu.fsdp_does_nothing("cpu", "fp32", module_dtype=torch.bfloat16)


@pytest.mark.numerics
def test_log_probs_match_fsdp2_mixed_precision_within_bf16_rounding_and_really_are_bf16(process_group,
                                                                                        tiny_model_dir):
    data = _data()
    mask = data.batch["response_mask"].bool()
    spec, micro = LogProbs(entropy=True), MicroBatching(size=4)
    plain, wrapped = _engine(tiny_model_dir, trainable=False), _engine(tiny_model_dir, trainable=False, single_rank="fsdp")
    seen = _head_dtypes(plain)
    a = plain.infer_batch(data, spec, micro)
    b = wrapped.infer_batch(data, spec, micro)
    fp32 = _engine(tiny_model_dir, mixed={}, trainable=False).infer_batch(data, spec, micro)
    assert seen and set(seen) == {torch.bfloat16}  # the matmuls ran in bf16
    assert a["log_probs"].dtype == torch.float32  # log-softmax in fp32
    diff = (a["log_probs"] - b["log_probs"])[mask].abs()
    assert diff.max() <= LOG_PROB_MAX and diff.mean() <= LOG_PROB_MEAN, (diff.max(), diff.mean())
    assert (a["entropy"] - b["entropy"])[mask].abs().max() <= LOG_PROB_MAX
    off = (a["log_probs"] - fp32["log_probs"])[mask].abs()
    assert off.mean() > 1e-5 and off.max() <= LOG_PROB_MAX  # not fp32, and no farther from it than bf16
    assert torch.all(a["log_probs"][~mask] == 0)


@pytest.mark.numerics
def test_an_update_matches_fsdp2_mixed_with_fp32_master_weights_and_gradients(process_group, tiny_model_dir):
    """Adam with eps=1 and lr=1: each weight moves by ≈ -gradient, so the weight change compares the
    gradients themselves (a tiny eps would move every weight by ±lr whatever its gradient's size)."""
    data = _data()
    plain, wrapped = _engine(tiny_model_dir, eps=1.0), _engine(tiny_model_dir, eps=1.0, single_rank="fsdp")
    seen = _head_dtypes(plain)
    m_plain, g_plain, dw_plain = _step(plain, data)
    m_wrapped, _, dw_wrapped = _step(wrapped, data)
    assert seen and set(seen) == {torch.bfloat16}  # the training forward autocast too
    assert {dtype for dtype, _ in g_plain.values()} == {torch.float32}  # master weights
    assert {g.dtype for _, g in g_plain.values()} == {torch.float32}  # and their gradients
    assert {p.dtype for p in plain.module.parameters()} == {torch.float32}
    # bf16 autocast (u = 2^-8) vs FSDP2's bf16 mixed precision, rounded at other points: ~0.1% of the loss
    assert m_plain["sft/loss"][0] == pytest.approx(m_wrapped["sft/loss"][0], rel=1e-3)
    assert m_plain["actor/grad_norm"][0] == pytest.approx(m_wrapped["actor/grad_norm"][0], rel=5e-3)
    # eps=1 makes Adam's step ~ -g: the gradients compared normwise, within bf16 rounding (2^-8) x a few layers
    assert 0 < _rel(dw_plain, dw_wrapped) <= 3e-2
    moved = max(float(v.abs().max()) for v in dw_plain.values())
    assert moved > 1e-3


@pytest.mark.numerics
def test_gradient_checkpointing_under_autocast_is_the_same_step(process_group, tiny_model_dir):
    """The recomputed forward runs under the autocast state of the first (torch.utils.checkpoint
    keeps it): the same bf16 activations, the same gradients."""
    data = _data()
    m_off, _, dw_off = _step(_engine(tiny_model_dir, eps=1.0), data)
    checkpointed = _engine(tiny_model_dir, eps=1.0, fields={"gradient_checkpointing": True})
    m_on, _, dw_on = _step(checkpointed, data)
    # checkpointing recomputes the same bf16 forward: rounding-level (fp32 accumulation of the recomputed grads)
    assert m_on["actor/grad_norm"][0] == pytest.approx(m_off["actor/grad_norm"][0], rel=1e-5)
    # eps=1: the step is ~ -g, so this is the gradients' normwise difference: fp32 re-association only
    assert _rel(dw_on, dw_off) <= 1e-5
    rollout = HFRollout(checkpointed.rollout_module(), {"n": 1, "response_length": 3}, pad_token_id=0, eos_token_id=1)
    prompts = data[:2].select(batch_keys=["input_ids", "attention_mask", "position_ids"])
    assert rollout.generate_sequences(prompts).batch["responses"].shape == (2, 3)  # the copy decodes (no checkpointing)


@pytest.mark.numerics
def test_save_then_load_reproduces_the_next_step_exactly(process_group, tiny_model_dir, tmp_path):
    data = _data()
    first = _engine(tiny_model_dir)
    _step(first, data)
    first.save_checkpoint(str(tmp_path / "ckpt"), {})
    m_straight, _, dw_straight = _step(first, data)
    resumed = _engine(tiny_model_dir)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert fu.plain_autocast_dtype(resumed.module) == torch.bfloat16
    assert {p.dtype for p in resumed.module.parameters()} == {torch.float32}
    m_resumed, _, dw_resumed = _step(resumed, data)
    assert m_resumed == m_straight
    for name in dw_straight:
        torch.testing.assert_close(dw_resumed[name], dw_straight[name], atol=0, rtol=0, msg=name)
    assert _weights(resumed).keys() == _weights(first).keys()
    for name, w in _weights(resumed).items():
        assert torch.equal(w, _weights(first)[name]), name
    # the HF export holds the fp32 master weights as they are
    exported = load_file(str(Path(resumed.save_hf_model(str(tmp_path / "hf"))) / "model.safetensors"))
    for name, w in _weights(resumed).items():
        if name in exported:
            assert exported[name].dtype == torch.float32 and torch.equal(exported[name], w), name


def test_the_hf_rollout_decodes_from_a_bf16_copy_refreshed_after_every_update(process_group, tiny_model_dir):
    engine = _engine(tiny_model_dir)
    rollout = HFRollout(engine.rollout_module(), {"n": 2, "response_length": 6, "temperature": 1.0, "seed": 3},
                        pad_token_id=0, eos_token_id=1)
    master = engine.module
    assert rollout.actor_module is master and rollout.module is not master

    def assert_rounded_copy() -> None:
        held = dict(rollout.module.named_parameters())
        assert held.keys() == dict(master.named_parameters()).keys()
        for name, p in master.named_parameters():
            assert held[name].dtype == torch.bfloat16 and not held[name].requires_grad, name
            assert held[name].data_ptr() != p.data_ptr(), name
            assert torch.equal(held[name], p.detach().to(torch.bfloat16)), name

    assert_rounded_copy()
    if master.config.tie_word_embeddings:
        assert rollout.module.get_output_embeddings().weight is rollout.module.get_input_embeddings().weight
    assert fu.plain_autocast_dtype(rollout.module) is None  # the copy computes as it is
    prompts = _data()[:2].select(batch_keys=["input_ids", "attention_mask", "position_ids"])
    out = rollout.generate_sequences(prompts)
    assert out.batch["responses"].shape == (4, 6) and torch.isfinite(out.batch["rollout_log_probs"]).all()

    storage = {n: p.data_ptr() for n, p in rollout.module.named_parameters()}
    _step(engine, _data())
    stale = dict(rollout.module.named_parameters())["model.embed_tokens.weight"]
    assert not torch.equal(stale, master.get_input_embeddings().weight.detach().to(torch.bfloat16))
    rollout.on_actor_update()  # what the worker calls after every update (and after a checkpoint load)
    assert_rounded_copy()
    assert {n: p.data_ptr() for n, p in rollout.module.named_parameters()} == storage  # refreshed in place
    assert rollout.generate_sequences(prompts).batch["responses"].shape == (4, 6)


def test_an_fp32_or_wrapped_actor_has_no_rollout_copy(process_group, tiny_model_dir):
    for engine in (_engine(tiny_model_dir, mixed={}), _engine(tiny_model_dir, single_rank="fsdp")):
        rollout = HFRollout(engine.rollout_module(), {"n": 1, "response_length": 2}, pad_token_id=0, eos_token_id=1)
        assert rollout.module is engine.module and rollout.actor_module is None


def test_the_static_decode_runs_on_the_bf16_copy(process_group, tiny_model_dir):
    """The static-shape decode (what CUDA compiles into graphs) reads the copy's bf16 weights."""
    engine = _engine(tiny_model_dir)
    rollout = HFRollout(engine.rollout_module(), {"n": 2, "response_length": 6, "temperature": 1.0, "seed": 3},
                        pad_token_id=0, eos_token_id=1, static_decode=True)
    prompts = _data()[:2].select(batch_keys=["input_ids", "attention_mask", "position_ids"])
    out = rollout.generate_sequences(prompts)
    assert rollout._static is not None and rollout._static.module is rollout.module
    assert out.batch["responses"].shape == (4, 6) and torch.isfinite(out.batch["rollout_log_probs"]).all()


def test_the_hybrid_worker_in_bf16_autocast_starts_at_kl_0_and_its_rollout_follows_each_update(tiny_model_dir,
                                                                                               tokenizer):
    """Through the worker (``fsdp_config.mixed_precision.param_dtype=bf16`` on one CPU rank): the actor
    and the reference are plain modules under autocast, so the first step's old and reference log-probs
    are the same numbers (KL 0, as under FSDP2); ``update_actor`` refreshes the rollout's bf16 copy."""
    from tests.workers import local_worker, make_prompts, worker_config

    bf16 = ["actor.fsdp_config.mixed_precision.param_dtype=bf16", "ref.fsdp_config.mixed_precision.param_dtype=bf16",
            "actor.ppo_mini_batch_size=2", "actor.use_kl_loss=true"]
    group = local_worker(worker_config(tiny_model_dir, bf16))
    worker = group.worker
    actor, ref = worker.engine.module, worker.ref_policy.engine.module
    assert fu.plain_autocast_dtype(actor) == fu.plain_autocast_dtype(ref) == torch.bfloat16
    assert worker.rollout.actor_module is actor
    data = group.generate_sequences(make_prompts(tokenizer, ["hello world", "a", "the quick brown fox", "12+7="]))
    data.meta_info = {"temperature": 1.0}
    old, ref_lp = group.compute_log_prob(data), group.compute_ref_log_prob(data)
    assert torch.equal(old.batch["old_log_probs"], ref_lp.batch["ref_log_prob"])
    data = data.union(old).union(ref_lp)
    gen = torch.Generator().manual_seed(0)
    data.batch["advantages"] = torch.randn(data.batch["response_mask"].shape, generator=gen) * data.batch["response_mask"]
    before = actor.get_input_embeddings().weight.detach().clone()
    metrics = group.update_actor(data).meta_info["metrics"]
    assert all(torch.isfinite(torch.tensor(v)).all() for k, v in metrics.items() if k.startswith("actor/"))
    assert not torch.equal(before, actor.get_input_embeddings().weight)
    held = dict(worker.rollout.module.named_parameters())
    for name, p in actor.named_parameters():
        assert torch.equal(held[name], p.detach().to(torch.bfloat16)), name
    assert len(group.generate_sequences(make_prompts(tokenizer, ["a"]))) == 2


def test_a_lora_actor_trains_its_adapter_under_autocast_and_its_rollout_copy_carries_it(process_group, tiny_model_dir):
    pytest.importorskip("peft")
    from rlfoundry.models.lora import LoraSpec

    engine = _engine(tiny_model_dir, fields={"lora": LoraSpec(rank=4, alpha=8)})
    assert engine.lora and fu.plain_autocast_dtype(engine.module) == torch.bfloat16
    seen = _head_dtypes(engine)
    rollout = HFRollout(engine.rollout_module(), {"n": 1, "response_length": 4}, pad_token_id=0, eos_token_id=1)
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    _step(engine, _data())
    moved = {n for n, p in engine.module.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all("lora_" in n for n in moved) and set(seen) == {torch.bfloat16}
    rollout.on_actor_update()
    held = dict(rollout.module.named_parameters())
    for name in moved:
        assert torch.equal(held[name], dict(engine.module.named_parameters())[name].detach().to(torch.bfloat16)), name
    prompts = _data()[:2].select(batch_keys=["input_ids", "attention_mask", "position_ids"])
    assert rollout.generate_sequences(prompts).batch["responses"].shape == (2, 4)
    with engine.adapter_disabled():  # a LoRA run's reference: the base model, under the same autocast
        base = engine.infer_batch(_data(), LogProbs(), MicroBatching(size=4))["log_probs"]
    assert torch.isfinite(base).all()


@pytest.mark.numerics
def test_a_critic_gives_fp32_values_matching_fsdp2_mixed(process_group, tiny_critic_dir):
    """Measured: values up to 0.42, the two paths 2.9e-3 apart (autocast 1.7e-3 from fp32, FSDP2 3.7e-3)."""
    from rlfoundry.engines.base import Values

    data = _data()
    mask = data.batch["response_mask"].bool()
    critic = {"model_kind": "token_classification"}
    plain = _engine(tiny_critic_dir, trainable=False, fields=critic)
    wrapped = _engine(tiny_critic_dir, trainable=False, fields=critic, single_rank="fsdp")
    assert fu.plain_autocast_dtype(plain.module) == torch.bfloat16
    a = plain.infer_batch(data, Values(), MicroBatching(size=4))["values"]
    b = wrapped.infer_batch(data, Values(), MicroBatching(size=4))["values"]
    assert a.dtype == torch.float32
    scale = float(b[mask].abs().max())
    # bf16 autocast vs FSDP2's bf16 mixed precision: 2^-8 x a few layers, relative to the values' scale
    assert float((a - b)[mask].abs().max()) <= 2e-2 * max(scale, 1.0), (a - b)[mask].abs().max()


@pytest.mark.numerics
def test_a_vision_language_model_takes_its_pixels_under_autocast_and_decodes_from_its_copy(process_group, tiny_vlm_dir,
                                                                                          image_batch):
    """Image rows through the plain bf16 path: log-probs within the bf16 bound of FSDP2 mixed, and the
    rollout's bf16 copy (vision tower included) samples from image prompts. Measured: 1.5e-3 max,
    6.3e-4 mean."""
    mask = image_batch.batch["response_mask"].bool()
    plain = _engine(tiny_vlm_dir, trainable=False)
    wrapped = _engine(tiny_vlm_dir, trainable=False, single_rank="fsdp")
    assert fu.plain_autocast_dtype(plain.module) == torch.bfloat16
    a = plain.infer_batch(image_batch, LogProbs(), MicroBatching(size=2))["log_probs"]
    b = wrapped.infer_batch(image_batch, LogProbs(), MicroBatching(size=2))["log_probs"]
    diff = (a - b)[mask].abs()
    assert diff.max() <= LOG_PROB_MAX and diff.mean() <= LOG_PROB_MEAN, (diff.max(), diff.mean())
    text = plain.module.config.text_config
    rollout = HFRollout(plain.rollout_module(), {"n": 2, "response_length": 4, "temperature": 1.0, "seed": 3},
                        pad_token_id=text.pad_token_id, eos_token_id=text.eos_token_id)
    assert {p.dtype for p in rollout.module.parameters()} == {torch.bfloat16}
    tp = image_batch.batch["input_ids"].shape[1] - image_batch.batch["responses"].shape[1]
    prompts = DataProto.from_dict(
        tensors={k: image_batch.batch[k][..., :tp] for k in ("input_ids", "attention_mask", "position_ids")},
        non_tensors={"multi_modal_inputs": image_batch.non_tensor_batch["multi_modal_inputs"]})
    out = rollout.generate_sequences(prompts)
    assert out.batch["responses"].shape == (8, 4) and torch.isfinite(out.batch["rollout_log_probs"]).all()
