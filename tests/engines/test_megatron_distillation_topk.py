"""Top-k distillation (``forward_kl_topk``) on the Megatron engine at TP=2 (vocabulary-parallel logits, sequence
parallelism on), CPU processes over gloo, against the 1-rank FSDP2 engine on the same rows:

- the teacher's side, ``LogProbs.topk``: the k likeliest tokens of the whole vocabulary and their log-probs,
  merged from the two ranks' slices, equal the FSDP engine's (ids exactly, log-probs to fp32 rounding);
- the student's side: one actor update with the top-k loss alone (two optimiser steps; the log-probs of the
  teacher's ids gathered from the slice that holds each id, normalised over both) moves the weights as the
  FSDP update does, and logs the same loss and teacher/student masses.

The teacher here is the model itself at temperature 0.5 (sharper), its top-4 written into the batch."""

from __future__ import annotations

import pytest
import torch

from tests.engines.megatron_ranks import run_ranks
from tests.engines.test_megatron_engine import MINI, MICRO, _actor_config, _initial, _scored_batch

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")

pytestmark = [pytest.mark.slow, pytest.mark.numerics]
K = 4
LOSS = {"loss_mode": "forward_kl_topk", "topk": K, "use_task_rewards": False, "log_prob_min_clamp": -10.0}
METRICS = ("distillation/loss", "distillation/teacher_mass", "distillation/student_mass", "actor/grad_norm")


def _with_teacher(model_dir: str):
    from transformers import AutoModelForCausalLM

    data = _scored_batch(model_dir)
    batch = data.batch
    width = batch["responses"].shape[1]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits[:, -width - 1:-1]
    top = torch.log_softmax(logits / 0.5, -1).topk(K, -1)
    batch["teacher_logprobs"], batch["teacher_ids"] = top.values, top.indices
    return data


def _actor(model_dir: str, engine):
    from rlfoundry.config.schema import DistillationLossConfig
    from rlfoundry.config.typed import to_typed
    from rlfoundry.workers.actor import ActorBatchSizes, DataParallelPPOActor

    return DataParallelPPOActor(_actor_config(model_dir), engine, ActorBatchSizes(MINI, MICRO),
                                distillation_loss=to_typed(DistillationLossConfig, LOSS))


def _fsdp(rank: int, model_dir: str, data):
    from rlfoundry.config.schema import FSDPConfig
    from rlfoundry.engines.fsdp.engine import FSDPEngine, FSDPEngineConfig

    cfg = _actor_config(model_dir)
    engine = FSDPEngine.build(FSDPEngineConfig(path=model_dir, fsdp=FSDPConfig(), optim=cfg.optim,
                                               grad_clip=cfg.grad_clip, cpu_kernels="off"), "cpu")
    actor = _actor(model_dir, engine)
    top = actor.compute_log_prob_outputs(data, topk=K)
    return top, actor.update_policy(data), dict(engine.iter_hf_weights())


def _megatron(rank: int, model_dir: str, data):
    from rlfoundry.config.schema import MegatronConfig
    from rlfoundry.engines.megatron.engine import MegatronEngine, MegatronEngineConfig

    cfg = _actor_config(model_dir)
    megatron = MegatronConfig(tensor_model_parallel_size=2, dtype="float32")
    engine = MegatronEngine(MegatronEngineConfig(model_dir, megatron, cfg.optim, cfg.grad_clip), "cpu")
    actor = _actor(model_dir, engine)
    top = actor.compute_log_prob_outputs(data, topk=K)
    return top, actor.update_policy(data), dict(engine.iter_hf_weights())


def test_top_k_distillation_at_tp2_equals_fsdp(tiny_model_dir, tmp_path):
    model_dir = str(tiny_model_dir)
    data = _with_teacher(model_dir)
    [(ref_top, ref_metrics, ref_weights)] = run_ranks(_fsdp, 1, tmp_path, args=(model_dir, data))
    mask = data.batch["response_mask"].bool()
    moved = max((ref_weights[k] - v).abs().max().item() for k, v in _initial(model_dir).items())
    assert moved > 1e-3  # the update moved the weights: equality is not vacuous
    for top, metrics, weights in run_ranks(_megatron, 2, tmp_path, tp=2, args=(model_dir, data)):
        assert torch.equal(top["topk_ids"][mask], ref_top["topk_ids"][mask])
        torch.testing.assert_close(top["topk_log_probs"], ref_top["topk_log_probs"], atol=1e-5, rtol=0)
        for key in METRICS:
            assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-4, abs=1e-6), key
        for name, tensor in ref_weights.items():
            # the bound of test_megatron_engine.py (optim.eps=1e-4 there too)
            torch.testing.assert_close(weights[name], tensor, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
