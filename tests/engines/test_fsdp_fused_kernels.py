"""verl's ``model.use_fused_kernels`` on the FSDP engine: log-probs, entropies, loss and gradient norm
equal the unfused forward's on every causal-LM path (padded, packed, shared prompt), with a tied and an
untied LM head, plain and wrapped in FSDP2; and the model's head really returns (log-prob, entropy)
pairs instead of logits."""

from __future__ import annotations

import pytest
import torch

from rlfoundry.config.schema import FSDPConfig, OptimConfig
from rlfoundry.engines.base import LogProbs, LossOutput, MicroBatching, UpdatePlan
from rlfoundry.engines.fsdp.engine import FSDPEngine, FSDPEngineConfig
from rlfoundry.protocol import DataProto
from tests.engines.test_fsdp_utils import process_group  # noqa: F401 - fixture
from tests.engines.test_fsdp_vision import image_batch  # noqa: F401 - fixture
from tests.workers import assert_same_gradients, first_step_gradients, reassociation_bound, vocab_rows

PATHS = {  # (use_remove_padding, use_shared_prompt)
    "padded": (False, False),
    "packed": (True, False),
    "shared_prompt": (False, True),
}


@pytest.fixture(scope="module", params=["untied", "tied"])
def model_dir(request, tmp_path_factory):
    from rlfoundry.models.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp(f"fused-{request.param}"),
                           tie_word_embeddings=request.param == "tied")


def _batch() -> DataProto:
    """2 prompts x 3 samples (left-padded prompts of 6 and 8 tokens, responses of 7, 3 and 5 tokens):
    sharing each prompt computes 2 x 8 + 6 x 7 = 58 tokens instead of 6 x 15 = 90."""
    gen = torch.Generator().manual_seed(0)
    tp, tr = 8, 7
    prompts = torch.randint(3, 200, (2, tp), generator=gen).repeat_interleave(3, dim=0)
    responses = torch.randint(3, 200, (6, tr), generator=gen)
    mask = torch.ones(6, tp + tr, dtype=torch.long)
    mask[:3, :2] = 0  # the first prompt has 6 tokens
    for row, length in enumerate([7, 3, 5, 7, 5, 3]):
        mask[row, tp + length:] = 0
    prompts[:3, :2] = 0
    responses = responses.masked_fill(mask[:, tp:] == 0, 0)
    return DataProto.from_dict(tensors={
        "input_ids": torch.cat([prompts, responses], 1), "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0), "responses": responses,
        "response_mask": mask[:, tp:].clone(),
    })


def _loss(outputs, batch, info) -> LossOutput:
    """Token-mean NLL minus 0.1 x entropy: both outputs carry gradient (their backward terms both count)."""
    mask = batch["response_mask"]
    total = (-outputs["log_probs"] - 0.1 * outputs["entropy"]) * mask
    loss = total.sum() / info["batch_num_tokens"] * info["dp_size"]
    return LossOutput(loss, {"actor/loss": float(loss.detach())}, {})


def _engine(model_dir, path: str, fused: bool, wrap: str, lora=None, cpu_kernels="off", sp=1,
            **options) -> FSDPEngine:
    remove_padding, shared = PATHS[path]
    config = FSDPEngineConfig(path=str(model_dir), fsdp=FSDPConfig(single_rank=wrap), grad_clip=1.0,
                              cpu_kernels=cpu_kernels, optim=OptimConfig(lr=1e-2, weight_decay=0.0),
                              use_remove_padding=remove_padding, use_shared_prompt=shared,
                              use_fused_kernels=fused, fused_kernel_options=options, lora=lora,
                              ulysses_sequence_parallel_size=sp)
    return FSDPEngine.build(config, "cpu", role="actor")


def _head_widths(engine: FSDPEngine) -> list[int]:
    """The last dim of every ``logits`` the model returns (V unfused, 2 where the fused head ran)."""
    widths: list[int] = []
    engine.module.register_forward_hook(lambda _m, _a, out: widths.append(out.logits.shape[-1]))
    return widths


@pytest.mark.parametrize("wrap", ["auto", "fsdp"])  # one rank: a plain module, or wrapped in FSDP2 anyway
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.numerics
def test_fused_log_probs_and_update_equal_the_unfused(process_group, model_dir, path, wrap):
    data = _batch()
    spec = LogProbs(temperature=0.7, entropy=True)
    plan = UpdatePlan(mini_batch_size=6, micro=MicroBatching(size=3))
    results = {}
    for fused in (False, True):
        engine = _engine(model_dir, path, fused, wrap)
        widths = _head_widths(engine)
        inferred = engine.infer_batch(data, spec, MicroBatching(size=3))
        metrics = engine.train_batch(data, spec, _loss, plan)
        results[fused] = inferred, metrics, widths
    (plain, m_plain, w_plain), (fused, m_fused, w_fused) = results[False], results[True]
    vocab = w_plain[0]
    assert set(w_plain) == {vocab} and vocab > 100
    # shared prompt: the prompts' call keeps its logits (one position each), the responses' call is fused
    assert set(w_fused) == ({vocab, 2} if path == "shared_prompt" else {2})
    for key in ("log_probs", "entropy"):
        # the fused head sums the vocabulary in chunks: fp32 rounding only: the same forward in another order
        # (~u·sqrt(H + V)·|logit| ~ 1e-6 per log-prob)
        torch.testing.assert_close(fused[key], plain[key], atol=1e-5, rtol=1e-5)
    assert torch.all(fused["log_probs"][1, 3:] == 0) and torch.all(fused["entropy"][1, 3:] == 0)
    # losses/norms summed over the batch's tokens in another order: fp32 rounding, u x tokens x a few terms
    assert m_fused["actor/loss"] == pytest.approx(m_plain["actor/loss"], rel=1e-5)
    assert m_fused["actor/grad_norm"] == pytest.approx(m_plain["actor/grad_norm"], rel=1e-5)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.numerics
def test_with_the_cpu_kernels_fused_equals_their_unfused_forward(process_group, model_dir, path):
    """model.cpu_kernels=auto (the CPU default: oneDNN linears, the LM head among them, and the one-pass
    shared-prompt forward, which gives way to the HF two-call one under the fused head): the same
    log-probs, entropies, loss and gradient norm as the CPU kernels' unfused forward."""
    data, spec = _batch(), LogProbs(temperature=0.7, entropy=True)
    plan = UpdatePlan(mini_batch_size=6, micro=MicroBatching(size=3))
    out = {}
    for fused in (False, True):
        engine = _engine(model_dir, path, fused, "auto", cpu_kernels="auto")
        out[fused] = engine.infer_batch(data, spec, MicroBatching(size=3)), engine.train_batch(data, spec, _loss, plan)
    for key in ("log_probs", "entropy"):
        # the fused head sums the vocabulary in chunks: fp32 rounding only: the same forward in another order
        # (~u·sqrt(H + V)·|logit| ~ 1e-6 per log-prob)
        torch.testing.assert_close(out[True][0][key], out[False][0][key], atol=1e-5, rtol=1e-5)
    for key in ("actor/loss", "actor/grad_norm"):
        # losses/norms summed over the batch's tokens in another order: fp32 rounding, u x tokens x a few terms
        assert out[True][1][key] == pytest.approx(out[False][1][key], rel=1e-5)


@pytest.mark.numerics
def test_a_vision_language_model_fused_equals_unfused(process_group, tiny_vlm_dir, image_batch):  # noqa: F811
    """Qwen2-VL on image rows (one and two images) and a text row: the padded forward with pixels, the
    placeholders excluded from the vocabulary (never sampled) in the fused head as in the logits path."""
    spec = LogProbs(temperature=0.7, entropy=True)
    plan = UpdatePlan(mini_batch_size=4, micro=MicroBatching(size=2))
    out = {}
    for fused in (False, True):
        config = FSDPEngineConfig(path=str(tiny_vlm_dir), fsdp=FSDPConfig(), grad_clip=1.0, cpu_kernels="off",
                                  optim=OptimConfig(lr=1e-2, weight_decay=0.0), use_fused_kernels=fused)
        engine = FSDPEngine.build(config, "cpu", role="actor")
        widths = _head_widths(engine)
        out[fused] = (engine.infer_batch(image_batch, spec, MicroBatching(size=2)),
                      engine.train_batch(image_batch, spec, _loss, plan), widths)
    assert set(out[True][2]) == {2} and min(out[False][2]) > 2
    for key in ("log_probs", "entropy"):
        # the fused head sums the vocabulary in chunks: fp32 rounding only: the same forward in another order
        # (~u·sqrt(H + V)·|logit| ~ 1e-6 per log-prob)
        torch.testing.assert_close(out[True][0][key], out[False][0][key], atol=1e-5, rtol=1e-5)
    for key in ("actor/loss", "actor/grad_norm"):
        # losses/norms summed over the batch's tokens in another order: fp32 rounding, u x tokens x a few terms
        assert out[True][1][key] == pytest.approx(out[False][1][key], rel=1e-5)


@pytest.mark.parametrize("wrap", ["auto", "fsdp"])  # bf16 autocast over fp32 weights, or FSDP2's bf16 policy
@pytest.mark.numerics
def test_bf16_compute_fused_equals_unfused_within_bf16_rounding(process_group, model_dir, wrap):
    """bf16 compute (CUDA's default, here on the CPU): both paths take the head's product in bf16 and
    the softmax statistics in fp32, so they agree to bf16 rounding of the hidden states' product."""
    data, spec = _batch(), LogProbs(temperature=0.7, entropy=True)
    plan = UpdatePlan(mini_batch_size=6, micro=MicroBatching(size=3))
    out = {}
    for fused in (False, True):
        config = FSDPEngineConfig(path=str(model_dir), grad_clip=1.0, cpu_kernels="off",
                                  fsdp=FSDPConfig(single_rank=wrap, mixed_precision={"param_dtype": "bf16"}),
                                  optim=OptimConfig(lr=1e-2, weight_decay=0.0), use_fused_kernels=fused)
        engine = FSDPEngine.build(config, "cpu", role="actor")
        out[fused] = engine.infer_batch(data, spec, MicroBatching(size=3)), engine.train_batch(data, spec, _loss, plan)
    mask = data.batch["response_mask"].bool()
    for key in ("log_probs", "entropy"):
        diff = (out[True][0][key] - out[False][0][key])[mask].abs()
        print(f"bf16 {wrap} {key}: max {diff.max():.2e} mean {diff.mean():.2e}")
        assert diff.max() <= 2e-2 and diff.mean() <= 5e-3, (key, diff.max(), diff.mean())
    for key in ("actor/loss", "actor/grad_norm"):
        # bf16 matmuls (u = 2^-8) on both sides, rounded at different points: ~1% of the loss
        assert out[True][1][key] == pytest.approx(out[False][1][key], rel=2e-2)


@pytest.mark.numerics
def test_gradient_checkpointing_fused_equals_unfused(process_group, model_dir):
    """Layers recomputed in backward (model.enable_gradient_checkpointing): the fused head's backward,
    after its swap is undone, still gives the unfused loss and gradient norm."""
    data, spec = _batch(), LogProbs(temperature=0.7, entropy=True)
    plan = UpdatePlan(mini_batch_size=6, micro=MicroBatching(size=3))
    metrics = {}
    for fused in (False, True):
        config = FSDPEngineConfig(path=str(model_dir), fsdp=FSDPConfig(), grad_clip=1.0, cpu_kernels="off",
                                  optim=OptimConfig(lr=1e-2, weight_decay=0.0), use_remove_padding=True,
                                  gradient_checkpointing=True, use_fused_kernels=fused)
        metrics[fused] = FSDPEngine.build(config, "cpu", role="actor").train_batch(data, spec, _loss, plan)
    for key in ("actor/loss", "actor/grad_norm"):
        # losses/norms summed over the batch's tokens in another order: fp32 rounding, u x tokens x a few terms
        assert metrics[True][key] == pytest.approx(metrics[False][key], rel=1e-5)


@pytest.mark.numerics
def test_entropy_as_a_metric_and_the_triton_backend(process_group, model_dir):
    """entropy_grad=False (entropy only logged) leaves the NLL's gradient as it is; impl_backend=triton
    runs the torch backend (same numbers)."""
    data = _batch()
    spec = LogProbs(entropy=True, entropy_grad=False)
    plan = UpdatePlan(mini_batch_size=6, micro=MicroBatching(size=6))

    def nll(outputs, batch, info):
        assert not outputs["entropy"].requires_grad
        loss = -(outputs["log_probs"] * batch["response_mask"]).sum() / info["batch_num_tokens"]
        return LossOutput(loss, {"actor/loss": float(loss.detach())}, {})

    plain = _engine(model_dir, "padded", False, "auto").train_batch(data, spec, nll, plan)
    fused = _engine(model_dir, "padded", True, "auto", impl_backend="triton").train_batch(data, spec, nll, plan)
    # losses/norms summed over the batch's tokens in another order: fp32 rounding, u x tokens x a few terms
    assert fused["actor/grad_norm"] == pytest.approx(plain["actor/grad_norm"], rel=1e-5)


@pytest.mark.numerics
def test_lora_on_the_layers_fused_equals_unfused_and_an_adapted_head_is_refused(process_group, model_dir):
    """peft's all-linear LoRA leaves lm_head plain: the fused head runs under the peft wrapper with the
    same loss and gradient norm (the adapter's). An adapter on lm_head itself is a start-up error."""
    from rlfoundry.models.lora import LoraSpec

    data, spec = _batch(), LogProbs(temperature=0.7, entropy=True)
    plan = UpdatePlan(mini_batch_size=6, micro=MicroBatching(size=3))
    metrics = {fused: _engine(model_dir, "packed", fused, "auto", lora=LoraSpec(rank=4, alpha=8))
               .train_batch(data, spec, _loss, plan) for fused in (False, True)}
    for key in ("actor/loss", "actor/grad_norm"):
        # losses/norms summed over the batch's tokens in another order: fp32 rounding, u x tokens x a few terms
        assert metrics[True][key] == pytest.approx(metrics[False][key], rel=1e-5)
    with pytest.raises(ValueError, match="use_fused_kernels=true needs the LM head to be a plain linear map"):
        _engine(model_dir, "padded", True, "auto", lora=LoraSpec(rank=4, alpha=8, target_modules=["lm_head"]))


def test_an_unknown_backend_is_a_start_up_error(process_group, model_dir):
    with pytest.raises(ValueError, match="impl_backend='cuda'"):
        _engine(model_dir, "padded", True, "auto", impl_backend="cuda")


# ---- two ranks: the LM head's weight sharded by FSDP2 ---------------------------------------------


def _rank_main(rank: int, store: str, result: str, model_dir, data: DataProto) -> None:
    import os
    import sys

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    mine = data.chunk(2)[rank]  # rank 0 the first prompt's 3 rows, rank 1 the second's
    out = {}
    for path in PATHS:
        for fused in (False, True):
            engine = _engine(model_dir, path, fused, "auto")  # two ranks: wrapped, each unit sharded
            spec = LogProbs(temperature=0.7, entropy=True)
            inferred = engine.infer_batch(mine, spec, MicroBatching(size=3))
            metrics = engine.train_batch(mine, spec, _loss, UpdatePlan(mini_batch_size=3, micro=MicroBatching(size=2)))
            out[path, fused] = {**inferred, "metrics": dict(metrics),
                                "grads": first_step_gradients(engine.optimizer, engine.module)}
    for fused in (False, True):  # Ulysses SP=2: both ranks run the pooled rows, each a slice of the pack
        engine = _engine(model_dir, "packed", fused, "auto", sp=2)
        widths = _head_widths(engine)
        spec = LogProbs(temperature=0.7, entropy=True)
        rows, own = engine.model_parallel_rows(mine)
        inferred = engine.infer_batch(rows, spec, MicroBatching(size=3))
        metrics = engine.train_batch(rows, spec, _loss, UpdatePlan(mini_batch_size=6, micro=MicroBatching(size=3)))
        out["ulysses", fused] = {**{k: v[own] for k, v in inferred.items()}, "metrics": dict(metrics), "widths": widths,
                                 "grads": first_step_gradients(engine.optimizer, engine.module)}
    torch.save(out, f"{result}.{rank}")
    dist.destroy_process_group()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)  # skip gloo's thread teardown (see tests/workers/test_critic.py)


@pytest.mark.numerics
def test_two_sharded_ranks_fused_equal_unfused(process_group, tmp_path):
    """Over two gloo ranks (FSDP2 shards every unit, the LM head's weight included; tied, so the head's
    gradient meets the embedding's): on each path, and packed under Ulysses SP=2 (each rank's head on
    its slice of the pack), the fused log-probs, entropies, loss, grad norm and the gradients of one AdamW
    step equal the unfused."""
    from tests import rank_server

    from rlfoundry.models.tiny import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "tied", tie_word_embeddings=True)

    rank_server.run(_rank_main, args=(str(tmp_path / "store"), str(tmp_path / "out.pt"), model_dir, _batch()), nprocs=2)
    for rank in (0, 1):
        out = torch.load(f"{tmp_path / 'out.pt'}.{rank}")
        assert set(out["ulysses", True]["widths"]) == {2} and min(out["ulysses", False]["widths"]) > 2
        for path in (*PATHS, "ulysses"):
            plain, fused = out[path, False], out[path, True]
            for key in ("log_probs", "entropy"):
                # the fused head sums the vocabulary in chunks: fp32 rounding only: the same forward in another order
                # (~u·sqrt(H + V)·|logit| ~ 1e-6 per log-prob)
                torch.testing.assert_close(fused[key], plain[key], atol=1e-5, rtol=1e-5, msg=f"{path} {key}")
            for key in ("actor/loss", "actor/grad_norm"):
                # losses/norms summed over the batch's tokens in another order: fp32 rounding, u x tokens x a few terms
                assert fused["metrics"][key] == pytest.approx(plain["metrics"][key], rel=1e-5), (path, key)
            # the gradients of the step, not the weights after it: Adam's first step moves a weight by ~lr
            # whatever its gradient's size, so a gradient at fp32 rounding level may move it anywhere in
            # [-lr, lr] (#51). The fused head sums the vocabulary in chunks (re-association only); one that
            # drops the temperature or the entropy term is off by >= 1e-2 (tests/workers/test_fused_kernels_worker.py)
            vocab = vocab_rows(plain["grads"])
            bound = reassociation_bound(vocab, int(_batch().batch["input_ids"].numel()))
            assert_same_gradients(fused["grads"], plain["grads"], bound, path)
